"""`lora` on every REST shape that reaches an image or video DiT: the edit form's one JSON-array
field, a video's JSON body and form, a chat image recipe's body, and the gRPC messages; each
refusal is a 400 naming `lora`."""

from __future__ import annotations

import pytest

from stagemesh.gateway.chat.protocol import chat_image_request
from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.grpc.native import image_request, video_request
from stagemesh.gateway.images.edit_forms import edit_request
from stagemesh.gateway.mesh.stages import LoraChoice, LoraFacts
from stagemesh.gateway.videos.protocol import form_from_json
from stagemesh.gateway.videos.protocol import video_request as video_form_request
from stagemesh.gateway.wire.forms import Form
from stagemesh.gateway.wire.requests import parse_lora_text
from stagemesh.shared.proto.v1 import common_pb2
from stagemesh.shared.proto.v1 import gateway_service_pb2 as pb

INK = (LoraChoice("ink", 0.5), LoraChoice("wax"))
TEXT = '[{"name": "ink", "scale": 0.5}, {"name": "wax"}]'


def _form(**fields: str) -> Form:
    form = Form()
    for name, value in fields.items():
        form.fields[name] = [value]
    return form


def test_every_rest_shape_carries_lora() -> None:
    edit, _ = edit_request(_form(prompt="x", lora=TEXT))
    assert edit.image.lora == INK
    body = {"prompt": "x", "lora": [{"name": "ink", "scale": 0.5}, {"name": "wax"}]}
    assert video_form_request(form_from_json(body)).lora == INK
    assert video_form_request(_form(prompt="x", lora=TEXT)).lora == INK
    chat = {"messages": [{"role": "user", "content": "a cat"}], "lora": body["lora"]}
    assert chat_image_request(chat).lora == INK
    assert edit_request(_form(prompt="x"))[0].image.lora == ()


def test_grpc_requests_carry_lora_with_an_unset_scale_of_one() -> None:
    uses = [common_pb2.LoraAdapter(name="ink", scale=0.5), common_pb2.LoraAdapter(name="wax")]
    assert image_request(pb.GenerateImageRequest(prompt="x", lora=uses)).lora == INK
    assert image_request(pb.EditImageRequest(prompt="x", lora=uses)).lora == INK
    assert video_request(pb.CreateVideoRequest(prompt="x", lora=uses)).lora == INK


@pytest.mark.parametrize(
    "text", ["ink", "{}", '[{"name": ""}]', '[{"name": "ink", "scale": true}]']
)
def test_a_bad_form_field_names_lora(text: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_lora_text(text)
    assert caught.value.field_name == "lora"


def test_facts_check_names_lora() -> None:
    facts = LoraFacts(frozenset({"ink", "wax"}), 2, 2.0)
    facts.check(INK)
    for bad in [
        (LoraChoice("x"),),
        (LoraChoice("ink", -2.5),),
        (LoraChoice("ink", float("nan")),),
        (*INK, LoraChoice("ink")),
    ]:
        with pytest.raises(InvalidRequest) as caught:
            facts.check(bad)
        assert caught.value.field_name == "lora"
    with pytest.raises(InvalidRequest, match="serves no LoRA"):
        LoraFacts().check(INK)
