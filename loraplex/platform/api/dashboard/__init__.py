"""The operator dashboard: the page and `GET /admin/stats` (`serving_dashboard`), its login by a
signed cookie (`sessions`), the figures behind it (`stats`) and what it asks the engine for
between steps (`sources`); the page's files are in `static/`."""
