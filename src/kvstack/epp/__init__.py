"""kvstack as Envoy's endpoint picker (ext_proc): the same scheduling as the proxy, behind Envoy; and the
Envoy bootstrap it runs behind (`envoy_config`)."""
