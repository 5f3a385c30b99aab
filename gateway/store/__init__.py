"""Durable state: one SQLite file in the data dir (WAL, mode 0600) by default, or a
PostgreSQL database shared by several replicas (``--database-url``); see docs/scaling.md."""
