"""Children that a test stops with Ctrl-C (SIGINT)."""

import signal


def sigint_as_default() -> None:
    """``preexec_fn`` of such a child: SIGINT's default action, whatever the suite inherited.
    A background job of a non-interactive shell starts with SIGINT ignored, and an ignored
    signal stays ignored across exec: Python then installs no KeyboardInterrupt handler, and
    the child runs on through the test's Ctrl-C (the suite run as `bash .ci/run &` failed
    its five Ctrl-C tests that way)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
