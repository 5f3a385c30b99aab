"""The trainer's side of codebuddy2api, importable from the installed package.

The gateway itself is the ``gateway`` package; this one holds what a client program
imports: :mod:`codebuddy2api.client` (``Rollouts``, over the admin API; httpx only).
"""
