"""Pages generated at build time (mkdocs-gen-files runs this): the CLI reference from the
argparse parser, the HTTP reference from the server's OpenAPI document, the table of every
BUNSHIN_* variable, and the results pages from docs/results/*.json."""

from __future__ import annotations

import sys
from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "docs" / "gen")]

import cliref  # noqa: E402
import envvars  # noqa: E402
import httpref  # noqa: E402

from bunshin.bench import results  # noqa: E402

with mkdocs_gen_files.open("reference/cli.md", "w") as f:
    f.write(cliref.render())

spec = httpref.openapi()
with mkdocs_gen_files.open("reference/openapi.json", "w") as f:
    f.write(httpref.dumps(spec))
with mkdocs_gen_files.open("reference/http.md", "w") as f:
    f.write(httpref.render(spec))

with mkdocs_gen_files.open("reference/environment.md", "w") as f:
    f.write(envvars.render(envvars.scan(ROOT)))

with mkdocs_gen_files.open("results/index.md", "w") as f:
    f.write(results.render_page(results.load_all(ROOT / "docs" / "results")))
