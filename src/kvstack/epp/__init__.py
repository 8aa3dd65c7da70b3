"""kvstack as Envoy's endpoint picker (ext_proc): the same scheduling as the proxy, behind Envoy."""
