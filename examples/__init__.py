"""The example configs, installed with the package (fedsaddle.examples) as data: no code lives here.

The command line's built-in run is `paper-s10.yaml` (see fedsaddle/cli/shared.py).
"""
