"""Anthropic Messages: the room (parse, error shape, stream encoder) and the request
translation to chat.
"""
