"""Sans-IO MQTT 3.1.1 and 3.1: standard library only; never imports trio, the broker or server."""
