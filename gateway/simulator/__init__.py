"""The built-in upstream simulator: an OpenAI-compatible server whose model name picks a
scripted behaviour (scenarios, upstream quirks, token data, token-in, text completions).
It is not an upstream client: the gateway talks to it over real HTTP like any upstream.
"""
