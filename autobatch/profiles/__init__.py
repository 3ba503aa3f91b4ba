"""Profiles: the store (``store``), the cache rule and reporting (``cache``), and confirmation on
arrival of a plan predicted from another card (``confirmation``).
"""
