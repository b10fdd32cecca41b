"""An engine stand-in for the launcher test: in the environment `backport up` gives an
engine, turns on the PLE hook and gathers rows through the client the hook builds.

Run as `python -m tests.ple.engine_env_probe ID...`; prints one JSON line: whether the
hook turned on, whether it reads shared memory, and the SHA-256 of the gathered rows."""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

from services.engine.backport import ple as ple_hook


def main() -> None:
    installed = ple_hook.install()
    from services.engine.backport.ple.hook_settings import PleHookSettings
    from services.engine.backport.ple.service_embedding import _shared_client

    client = _shared_client(PleHookSettings.from_environment())
    rows = client.gather(np.array([int(i) for i in sys.argv[1:]], dtype=np.int64))
    print(json.dumps({"installed": installed, "address": client.address, "local": client.is_local,
                      "rows_sha256": hashlib.sha256(rows.tobytes()).hexdigest()}))
    client.close()


if __name__ == "__main__":
    main()
