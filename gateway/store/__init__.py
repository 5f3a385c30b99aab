"""Durable state: one SQLite file in the data dir (WAL, mode 0600) by default."""
