"""The HTTP endpoints of the client API: the generation routes, the models routes and
readiness.
"""
