"""The `shardkit` command line (entry point: shardkit.cli.main:main)."""
