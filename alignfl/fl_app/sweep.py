"""``python -m alignfl.fl_app.sweep``: the Hydra sweep's command, where people's notes and scripts have it.

The sweep is :mod:`alignfl.fl_app.sweeps.sweep`; import its names from there.
"""

from alignfl.fl_app.sweeps.sweep import main

if __name__ == "__main__":
    main()
