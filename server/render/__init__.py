"""graphdeck.server.render"""
