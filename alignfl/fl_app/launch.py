"""``python -m alignfl.fl_app.launch``: the launcher's command, where people's notes and scripts have it.

The launcher is :mod:`alignfl.fl_app.runtime.launch`; import its names from there.
"""

import sys

from alignfl.fl_app.runtime.launch import main

if __name__ == "__main__":
    sys.exit(main())
