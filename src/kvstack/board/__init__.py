"""The order board: what operators read and alert on, checked against what exporters really export.

``catalogs`` says which metric names exist (engines per type and version, kvstack's own components, a live
/metrics page); ``kvstack metrics check`` reads dashboards, rule files, PromQL files and Kubernetes manifests
and reports every name, suffix, label or label value that cannot match.
"""
