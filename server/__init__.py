"""graphdeck.server"""
