"""The operator console: a browser view of models, concepts, variants, calibrations, jobs and the audit log.

Static files only (``static/``: HTML, CSS and JavaScript modules, no build step, nothing fetched from
another origin), served under ``/ui`` by :func:`service.console.mount.install_console`. The pages hold
no data: their script asks for an API key, keeps it in the tab's ``sessionStorage`` and calls the public
API with it, so the console can do exactly what a client with that key can, and nothing more.
"""
