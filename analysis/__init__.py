"""graphdeck.analysis"""
