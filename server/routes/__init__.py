"""graphdeck.server.routes"""
