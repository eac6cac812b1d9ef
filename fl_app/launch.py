"""``python -m fl_app.launch``: the launcher's command, where people's notes and scripts have it.

The launcher is :mod:`fl_app.runtime.launch`; import its names from there.
"""

import sys

from fl_app.runtime.launch import main

if __name__ == "__main__":
    sys.exit(main())
