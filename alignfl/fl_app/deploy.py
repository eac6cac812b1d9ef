"""``python -m alignfl.fl_app.deploy``: the deployment's command, where people's notes and scripts have it.

The command is :mod:`alignfl.fl_app.runtime.deploy`; import its names from there.
"""

import sys

from alignfl.fl_app.runtime.deploy import main

if __name__ == "__main__":
    sys.exit(main())
