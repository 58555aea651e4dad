"""Runs one ``function_tool`` call inside the workspace, by path, under the image's python3.

Like ``pyrepl`` it imports nothing from the package and needs only the standard
library of Python >= 3.7. stdin: ``{"source", "name", "args"}``; the function's
source is executed in a fresh namespace and called with ``args`` as keywords. A
returned string is written as it is, anything else (but ``None``) as JSON; an
exception prints its traceback and exits 1.
"""

import json
import sys
import traceback


def main() -> int:
    req = json.loads(sys.stdin.read())
    ns: dict = {"__name__": "bunshin_tool"}
    try:
        exec(compile(req["source"], "<tool {}>".format(req["name"]), "exec"), ns)
        result = ns[req["name"]](**req["args"])
    except BaseException:
        traceback.print_exc()
        return 1
    if result is not None:
        sys.stdout.write(result if isinstance(result, str) else json.dumps(result, default=repr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
