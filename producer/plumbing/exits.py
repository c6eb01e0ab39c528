"""The exit codes of dq-producer and dq-gateway (docs/CLIENT.md); 130 is the shell's code for an interrupt
(128 + SIGINT)."""

OK, FAILED, USAGE, QUEUE_FULL, UNREACHABLE, INTERRUPTED = 0, 1, 2, 3, 4, 130
