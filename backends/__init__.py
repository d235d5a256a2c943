"""shardkit's built-in backend plugins, each registered through the ``shardkit`` entry-point group."""
