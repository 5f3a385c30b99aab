"""OpenAI Responses: the room (parse, resolve, store), the translation to and from chat,
the client-executed tools, the stream encoder, the WebSocket transport and compaction.
"""
