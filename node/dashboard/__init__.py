"""The run page (``swarmgrad dashboard``): a web page with a run's peers, and a node's loss
curve, rounds and contribution, refreshed live. ``server.py`` serves it (aiohttp, plotly.js);
``view.py`` says what it shows."""
