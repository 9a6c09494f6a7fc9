"""What the parts, the workers and the report share: launching processes (``util``), the formulas
(``metrics``, ``costmodel``), number formatting (``tables``) and the emulated hosts
(``netns_hosts``, which the multi-host tests import too)."""
