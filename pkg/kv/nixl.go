package kv

import (
	"bytes"
	"slices"

	"github.com/pd-extproc/pd-extproc/pkg/body"
)

// nixlKV drives vLLM's NixlConnector (pull mode): the prefill engine keeps the KV
// blocks and answers with the kv_transfer_params the decode engine needs to read
// them; we pass that object on byte for byte because new keys keep appearing.
type nixlKV struct{ vllmFamily }

// nixlPrefillParams asks the prefill engine to keep the blocks for a remote
// decode. Only do_remote_decode matters to vLLM; the null keys follow its proxies.
var nixlPrefillParams = []byte(`{"do_remote_decode":true,"do_remote_prefill":false,` +
	`"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

func (nixlKV) Dispatch() Dispatch     { return Sequential }
func (nixlKV) Paired() bool           { return false }
func (nixlKV) HandsBackParams() bool  { return true }
func (nixlKV) Rendezvous() Rendezvous { return NoRendezvous }

// RepeatedPull: NixlConnectorWorker._read_blocks and _get_new_notifs,
// nixl_connector.py @ 002a1057 (docs/envoy.md, "No fallbacks for a kv-nixl pull").
func (nixlKV) RepeatedPull() string {
	return "the prefill engine freed the blocks once the first pull read them, and a second read of the same ids " +
		"completes with no error: the decode engine computes from blocks other requests hold by then"
}

func (nixlKV) PrefillEdits(h *Handoff) []body.Edit {
	return append(slices.Clip(h.Shape.Caps), transferParams(h.Shape, nixlPrefillParams))
}

// DecodeEdits never sends do_remote_prefill without the prefill's remote_* fields:
// when the prefill returned no params (absent, null or {}, as vLLM's proxies
// read it) the decode engine simply recomputes. A do_remote_decode the
// prefill engine handed back is made false: true would have the decode
// engine keep the request's blocks after it finishes, for a remote decode
// that never comes, until its decoder_kv_blocks_ttl (480 s) runs out.
func (nixlKV) DecodeEdits(h *Handoff) []body.Edit {
	if !HasParams(h.PrefillKV) {
		return nil
	}
	params := h.PrefillKV
	if !remoteDecodeOff(params) {
		if o, err := body.Parse(params); err == nil {
			if v, ok := o.Raw("do_remote_decode"); ok && !bytes.Equal(v, body.False) {
				params = o.Splice(body.Set("do_remote_decode", body.False)).Bytes()
			}
		}
	}
	return []body.Edit{transferParams(h.Shape, params)}
}

var doRemoteDecode = []byte(`"do_remote_decode"`)

// remoteDecodeOff says, without parsing params (a block list may run to
// tens of kilobytes), that they hold no do_remote_decode but false: the key
// at most once, and then false, as vLLM's own answers have it. Otherwise
// DecodeEdits looks closer.
func remoteDecodeOff(params []byte) bool {
	switch bytes.Count(params, doRemoteDecode) {
	case 0:
		return true
	case 1:
		rest := bytes.TrimLeft(params[bytes.Index(params, doRemoteDecode)+len(doRemoteDecode):], " \t\r\n")
		return len(rest) > 0 && rest[0] == ':' && bytes.HasPrefix(bytes.TrimLeft(rest[1:], " \t\r\n"), body.False)
	}
	return false
}

// HasParams reports whether raw, a prefill answer's kv_transfer_params, hands
// anything to the decode engine: nothing, null and an empty object do not, as
// vLLM's proxies read it.
func HasParams(raw []byte) bool {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || body.IsNull(raw) {
		return false
	}
	return !(len(raw) >= 2 && raw[0] == '{' && len(bytes.TrimSpace(raw[1:len(raw)-1])) == 0)
}
