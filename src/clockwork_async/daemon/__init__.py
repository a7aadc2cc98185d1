"""The daemon process: its lifecycle (`lifecycle`), the parts built from the config
(`setup`), the `serve` verb, the admin service, metrics, the HTTP endpoint and systemd."""
