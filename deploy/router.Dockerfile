# The router image of deploy/kubernetes/replicas: vllm-router (Rust, from PyPI) at the version CI tests
# against (requirements-dev.txt). Built from anywhere (it copies nothing):
#
#   docker build -f deploy/router.Dockerfile -t REGISTRY/pagedserve-router:0.1.17 deploy
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install vllm-router==0.1.17 && useradd --uid 1000 --user-group --no-create-home router
USER 1000
EXPOSE 8000 29000
ENTRYPOINT ["vllm-router"]
