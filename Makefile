VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: run test install bench clean chromium

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q -c constraints.txt -e '.[dev,train]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m pagedmoe run

chromium:
	bash scripts/install_chromium.sh

test: $(STAMP) chromium
	$(PY) -m pytest -p no:cacheprovider tests

clean:
	rm -rf $(VENV) build *.egg-info
