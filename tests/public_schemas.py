"""Where JSONSchemaBench's public schemas are: $JSONSCHEMABENCH, else shared/ beside the repository (where the
workplace puts it, for a session's checkout and for CI's clone alike), else /work/shared."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def schemas_dir() -> Path:
    if os.environ.get("JSONSCHEMABENCH"):
        return Path(os.environ["JSONSCHEMABENCH"])
    beside = REPO.parent / "shared" / "jsonschemabench"
    return beside if beside.is_dir() else Path("/work/shared/jsonschemabench")
