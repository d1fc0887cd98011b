"""The test harness and what several test files share: helpers and constants, never fixtures
(those live in tests/conftest.py).

- `prefect_stack`: a real `prefect server`, pools, deployments and workers, from the README.
- `processes`: flows and scripts run in processes of their own, and their output.
- `reload_check`: a published checkpoint reloaded in a fresh process and compared with its base.
- `stand_ins`: module-level replacements for checks the flow runs in a child process.
- `models`, `recipes`, `plans`, `parameters`, `schema`: what tests build and compare.

Test files import them as `support.<module>`: tests/ is on sys.path, as the folder of the root
conftest.py.
"""
