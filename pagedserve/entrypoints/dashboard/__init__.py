"""The live dashboard (GET /dashboard, /dashboard/state) and the `pagedserve trace` report's HTML: two
views of the same trace data (engine/trace.py), rendered by static/trace.js."""
