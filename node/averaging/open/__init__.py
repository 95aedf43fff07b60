"""Open runs' round policy: signed chunks, owners' accounts, the members' checks, audits, evidence.

``policy.py`` is the :class:`~swarmgrad.node.averaging.policy.RoundPolicy` of a run whose spec
says ``trust.mode = "open"``; ``member.py`` and ``owner.py`` are its two sides of a round;
``accounts.py``, ``reports.py`` and ``checks.py`` check every owner's result after the round;
``audits.py`` aggregates a part again; ``evidence.py`` proves a broken rule to anyone.
"""
