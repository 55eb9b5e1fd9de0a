"""graphdeck.frontend"""
