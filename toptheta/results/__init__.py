"""The results store, tables and loggers."""
