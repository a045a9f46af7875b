"""``vmcgrad vmc --driver auto`` (the default): sample-space SR where the parameters outnumber the
samples (NetKet's rule of thumb, as its ``VMC_SR`` chooses), parameter-space SR otherwise, said in the
header with the numbers; a forced ``--driver sr`` where NetKet would warn gives one vmcgrad line
instead of NetKet's 16-line warning; a MinSR run names the route its steps actually take.
"""

import pytest
from helpers import N_DEVICES
from helpers import run_vmcgrad as _vmcgrad

from vmcgrad.cli import main, vmc

#: The MLP on 8 sites has 288 parameters: more than these 64 samples.
MLP = ["vmc", "--L", "8", "--model", "mlp", "--samples", "64", "--chunk-size", "32", "--steps", "1"]


@pytest.mark.parametrize(
    "option, p, n, grow, taken, said",
    [
        ("auto", 2120, 1024, False, "minsr", "2120 parameters > 1024 samples, so sample-space SR"),
        ("auto", 80, 256, False, "sr", "80 parameters <= 256 samples, so parameter-space SR"),
        ("auto", 80, 256, True, "minsr", "with --grow-samples: sample-space SR"),
        ("sr", 2120, 1024, False, "sr", "under-determined here; --driver auto takes minsr"),
        ("minsr", 80, 256, False, "minsr", "--driver auto would take sr"),
    ],
)
def test_the_rule_and_its_reason(option, p, n, grow, taken, said):
    got, why = vmc.choose_driver(option, p, n, grow)
    assert got == taken and said in why


def test_the_help_states_the_rule_and_auto_is_the_default(capsys):
    with pytest.raises(SystemExit):
        main(["vmc", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "auto: minsr where the parameters outnumber the samples (NetKet's rule of thumb" in text
    assert "(default: auto)" in text


@pytest.mark.slow
def test_auto_takes_minsr_for_more_parameters_than_samples_and_names_the_route(tmp_path):
    rc, stdout, err = _vmcgrad([*MLP, "--devices", str(N_DEVICES), "--out", str(tmp_path / "run")], tmp_path)
    assert rc == 0, err
    assert "driver minsr: --driver auto: 288 parameters > 64 samples, so sample-space SR" in stdout
    assert "step 1: MinSR route dense, the N x N kernel built in chunked blocks" in stdout
    assert "kernel chunk 32" in stdout and "N = 64" in stdout


@pytest.mark.slow
def test_a_forced_sr_with_too_few_samples_is_one_vmcgrad_line_not_netkets_warning(tmp_path):
    args = [*MLP, "--driver", "sr", "--devices", str(N_DEVICES), "--out", str(tmp_path / "run")]
    rc, stdout, err = _vmcgrad(args, tmp_path)
    assert rc == 0, err
    assert "driver sr: --driver sr as given, with 288 parameters > 64 samples" in stdout
    assert "InsufficientSamplesForSRWarning" not in err and "VMC_SR" not in err, err
