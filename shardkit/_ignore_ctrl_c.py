"""Imported first by the forkserver shardkit starts: from here on it, and every rank it forks,
ignores SIGINT.

Ctrl-C reaches the whole terminal process group; the caller alone answers it (its
KeyboardInterrupt stops every rank). Ignoring it here, inside the server, keeps the caller's
own handler untouched while the server starts: a Ctrl-C at any moment reaches the caller
(ignoring it in the caller for the server to inherit lost the ones pressed meanwhile).
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
