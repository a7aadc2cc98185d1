"""The API and its client stand on the wire alone: importing the client loads no runtime
module and nothing of the core but its outcome vocabulary (issue 25, point 4)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_client_loads_no_runtime_or_core_logic() -> None:
    code = (
        "import sys, clockwork_async.client, clockwork_async.api.server;"
        "print('\\n'.join(m for m in sys.modules if m.startswith('clockwork_async')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert not [m for m in loaded if m.startswith("clockwork_async.runtime")], loaded
    core = {m for m in loaded if m.startswith("clockwork_async.core.")}
    assert core == {"clockwork_async.core.outcomes"}, core
