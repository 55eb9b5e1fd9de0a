"""graphdeck.capture"""
