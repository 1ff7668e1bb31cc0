"""The test harness's forkserver preload: nothing in it may import fsspec, which reads its
configuration (a test's ``FSSPEC_S3``) from the environment once, when first imported, and
the forkserver's environment is the session's (CI met it: workers went to AWS, not moto)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.docs import REPO


def test_the_forkserver_preload_does_not_import_fsspec():
    code = (
        "import sys\n"
        "from tests.support.harness import _PRELOAD\n"
        "for name in _PRELOAD:\n"
        "    __import__(name)\n"
        "print('fsspec' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"
