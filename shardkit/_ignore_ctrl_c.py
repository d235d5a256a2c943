"""Imported first by the forkserver shardkit starts: from here on it, and every rank it forks,
ignores SIGINT.

Ctrl-C reaches the whole terminal process group; the caller alone answers it (its
KeyboardInterrupt stops every rank). The server is also started with SIGINT blocked and ignored
(spawn._ctrl_c_left_to_caller), which covers its Python start-up and the imports before this
module; this keeps it ignored whatever a preloaded module or a future start path does.
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
