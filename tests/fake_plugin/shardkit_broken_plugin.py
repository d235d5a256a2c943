"""A plugin whose import fails, as one with a missing vendor library would."""

raise ImportError("shardkit_broken_plugin needs libfrobnicate, which is not installed")
