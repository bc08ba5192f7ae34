"""What several test directories share: the one live `Fleet` (tests/support/fleet.py), the one
job client (jobs.py), scripted workers (workers.py), the one picture generator (images.py), the
tiny SDXL model built once per run (models.py), and the trainer-test helpers (training.py).
The fixtures themselves are in fixtures.py, loaded for the whole suite by tests/conftest.py."""
