"""Shoal networking: the only package that imports libp2p."""
