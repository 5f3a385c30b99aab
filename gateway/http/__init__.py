"""Below the routes: the ASGI layers (body limit, cross-site guard, admin surface), the TCP
connection bounds, the servers and worker processes, and graceful shutdown.
"""
