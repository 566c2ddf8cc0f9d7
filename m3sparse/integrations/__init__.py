"""Adapters that run other libraries' MiniMax-M3 models on m3sparse (optional dependencies)."""
