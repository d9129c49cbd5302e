"""The kvstore-server daemon (asyncio on uvloop). Never imports torch."""

from .app import Server

__all__ = ["Server"]
