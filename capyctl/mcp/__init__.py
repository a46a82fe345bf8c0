"""``capyctl mcp``: the MCP server for AI agents, a client of the management API (operator role)."""

from ._api import ApiError, ManagementApi, OperatorKey
from ._server import DEFAULT_LISTEN, MCP_PATH, build_app, build_server, is_loopback, serve, split_listen

__all__ = ["ApiError", "DEFAULT_LISTEN", "MCP_PATH", "ManagementApi", "OperatorKey", "build_app", "build_server",
           "is_loopback", "serve", "split_listen"]
