package handlers_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
)

// fuzzChecksum is the one trailer of every trailers message.
var fuzzChecksum = envoymsg.Header{"x-checksum", "1"}

// fuzzGen builds message sequences: ctl steers, data fills in.
type fuzzGen struct {
	ctl, data         *fuzzBytes
	reqMode, respMode filterv3.ProcessingMode_BodySendMode
}

func (g *fuzzGen) envoyLike(ctl [fuzzCtlLen]byte) []*extprocv3.ProcessingRequest {
	extra := ctl[ctlExtra]
	stream := extra&128 != 0
	body := g.body(int(ctl[ctlBody]), stream)
	get := ctl[ctlPath]&8 != 0
	if get {
		body = nil
	}
	trailers := extra&16 != 0 && !get

	hs := [][2]string{{":method", "POST"}, {":path", g.path(int(ctl[ctlPath]) & 7)}, {":authority", "gw"}, {":scheme", "http"}, {"content-type", "application/json"}}
	if get {
		hs[0][1] = "GET"
	}
	switch int(ctl[ctlLength]) % 6 {
	case 0:
		hs = append(hs, [2]string{"content-length", strconv.Itoa(len(body))})
	case 1: // chunked: none
	case 2:
		hs = append(hs, [2]string{"content-length", strconv.Itoa(len(body) + 1)})
	case 3:
		hs = append(hs, [2]string{"content-length", "abc"})
	case 4:
		hs = append(hs, [2]string{"content-length", strconv.Itoa(len(body))}, [2]string{"content-length", strconv.Itoa(len(body) + 7)})
	case 5:
		hs = append(hs, [2]string{"content-length", "-1"})
	}
	if extra&1 != 0 {
		// Envoy's codec refuses NUL, CR and LF in a value; anything else reaches us.
		id := bytes.Map(func(r rune) rune {
			if r == 0 || r == '\r' || r == '\n' {
				return 'x'
			}
			return r
		}, g.data.take(int(g.data.next())%40))
		hs = append(hs, [2]string{"x-request-id", string(bytes.TrimSpace(id))})
	}
	if extra&2 != 0 {
		hs = append(hs, [2]string{"authorization", "Bearer sk-secret"})
	}
	if extra&4 != 0 {
		hs = append(hs, [2]string{"traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
	}
	if extra&8 != 0 {
		hs = append(hs, [2]string{handlers.DestinationHeader, "6.6.6.6:666"})
	}
	noBody := len(body) == 0 && !trailers
	msgs := []*extprocv3.ProcessingRequest{envoymsg.Headers(envoymsg.Request, noBody, hs...)}
	if hint := fuzzSubsets[int(ctl[ctlSubset]&127)%len(fuzzSubsets)]; hint != nil {
		msgs[0].MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			handlers.SubsetHintNamespace: {Fields: map[string]*structpb.Value{handlers.SubsetHintKey: hint}},
		}}
	}

	if !noBody {
		switch g.reqMode {
		case filterv3.ProcessingMode_NONE:
		case filterv3.ProcessingMode_BUFFERED:
			msgs = append(msgs, envoymsg.Body(envoymsg.Request, body, !trailers))
		case filterv3.ProcessingMode_BUFFERED_PARTIAL:
			if ctl[ctlChunks]&128 != 0 && len(body) > 1 {
				// The buffer limit was reached: what is queued goes, the rest passes unseen.
				msgs = append(msgs, envoymsg.Body(envoymsg.Request, body[:len(body)/2], false))
				trailers = false
			} else {
				msgs = append(msgs, envoymsg.Body(envoymsg.Request, body, !trailers))
			}
		default:
			msgs = append(msgs, envoymsg.Chunks(envoymsg.Request, body, 1+int(ctl[ctlChunks]&7), !trailers)...)
		}
		if trailers {
			msgs = append(msgs, envoymsg.Trailers(envoymsg.Request, fuzzChecksum))
		}
	}

	if extra&32 != 0 { // the upstream answered: the response path
		var resp []byte
		for i := range int(ctl[ctlRespChunks]) % 4 {
			resp = fmt.Appendf(resp, "data: {\"choices\":[{\"delta\":{\"content\":\"tok%d\"}}]}\n\n", i)
		}
		respTrailers := extra&64 != 0
		respNoBody := len(resp) == 0 && !respTrailers
		status := "200"
		if ctl[ctlSubset]&128 != 0 {
			status = "503" // the decode engine failed: scheduling is told
		}
		msgs = append(msgs, envoymsg.Headers(envoymsg.Response, respNoBody, [2]string{":status", status}, [2]string{"content-type", "text/event-stream"}))
		if served := fuzzSubsets[int(ctl[ctlRespChunks]>>4)%len(fuzzSubsets)]; served != nil {
			// The endpoint a gateway reports serving the request, of any shape.
			msgs[len(msgs)-1].MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
				handlers.DestinationMetadata: {Fields: map[string]*structpb.Value{handlers.DestinationServedKey: served}},
			}}
		}
		if !respNoBody {
			switch g.respMode {
			case filterv3.ProcessingMode_NONE:
			case filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_BUFFERED_PARTIAL:
				msgs = append(msgs, envoymsg.Body(envoymsg.Response, resp, !respTrailers))
			default:
				msgs = append(msgs, envoymsg.Chunks(envoymsg.Response, resp, 1+int(ctl[ctlRespChunks]>>2&3), !respTrailers)...)
			}
			if respTrailers {
				msgs = append(msgs, envoymsg.Trailers(envoymsg.Response, fuzzChecksum))
			}
		}
	}

	for range int(ctl[ctlPerturb]) % 4 {
		msgs = g.perturb(msgs)
	}
	return msgs
}

// perturb applies one thing Envoy does not do in order (except the first,
// which it does: envoy#46237).
func (g *fuzzGen) perturb(msgs []*extprocv3.ProcessingRequest) []*extprocv3.ProcessingRequest {
	kind, at := int(g.ctl.next())%8, int(g.ctl.next())%(len(msgs)+1)
	insert := func(m *extprocv3.ProcessingRequest, at int) []*extprocv3.ProcessingRequest {
		return append(msgs[:at:at], append([]*extprocv3.ProcessingRequest{m}, msgs[at:]...)...)
	}
	switch kind {
	case 0: // the final request chunk again
		for i := len(msgs) - 1; i >= 0; i-- {
			if b := msgs[i].GetRequestBody(); b != nil && b.GetEndOfStream() {
				return insert(proto.Clone(msgs[i]).(*extprocv3.ProcessingRequest), i+1)
			}
		}
	case 1:
		if len(msgs) > 0 {
			return insert(proto.Clone(msgs[0]).(*extprocv3.ProcessingRequest), max(at, 1))
		}
	case 2:
		return insert(&extprocv3.ProcessingRequest{}, at)
	case 3:
		return insert(envoymsg.Body(envoymsg.Request, g.data.take(int(g.data.next())), g.data.next()&1 != 0), at)
	case 4:
		return insert(envoymsg.Body(envoymsg.Response, g.data.take(int(g.data.next())), g.data.next()&1 != 0), at)
	case 5:
		if at > 0 && at < len(msgs) {
			msgs[at].ProtocolConfig = &extprocv3.ProtocolConfiguration{
				RequestBodyMode:  fuzzModes[int(g.ctl.next())%len(fuzzModes)],
				ResponseBodyMode: fuzzModes[int(g.ctl.next())%len(fuzzModes)],
			}
		}
	case 6:
		if at < len(msgs) {
			return append(msgs[:at:at], msgs[at+1:]...)
		}
	case 7:
		if at+1 < len(msgs) {
			msgs[at], msgs[at+1] = msgs[at+1], msgs[at]
		}
	}
	return msgs
}

// chaos is an arbitrary sequence of n messages.
func (g *fuzzGen) chaos(n int) []*extprocv3.ProcessingRequest {
	var msgs []*extprocv3.ProcessingRequest
	for range n {
		kind, flags := int(g.ctl.next())%8, g.ctl.next()
		eos := flags&1 != 0
		var m *extprocv3.ProcessingRequest
		switch kind {
		case 0, 7:
			m = envoymsg.Headers(envoymsg.Request, eos, [2]string{":method", "POST"}, [2]string{":path", g.path(int(flags>>1) & 7)},
				[2]string{"content-length", strconv.Itoa(int(g.data.next()))})
		case 1:
			b := g.data.take(int(g.data.next()))
			if flags&64 != 0 {
				b = g.body(int(flags>>2), false)
			}
			m = envoymsg.Body(envoymsg.Request, b, eos)
		case 2:
			m = envoymsg.Trailers(envoymsg.Request, fuzzChecksum)
		case 3:
			m = envoymsg.Headers(envoymsg.Response, eos, [2]string{":status", "200"})
		case 4:
			m = envoymsg.Body(envoymsg.Response, g.data.take(int(g.data.next())), eos)
		case 5:
			m = envoymsg.Trailers(envoymsg.Response, fuzzChecksum)
		case 6:
			m = &extprocv3.ProcessingRequest{}
		}
		if flags&2 != 0 && len(msgs) > 0 {
			m.ProtocolConfig = &extprocv3.ProtocolConfiguration{
				RequestBodyMode:  fuzzModes[int(flags>>2)%len(fuzzModes)],
				ResponseBodyMode: fuzzModes[int(flags>>5)%len(fuzzModes)],
			}
		}
		msgs = append(msgs, m)
	}
	if n > 0 && len(msgs) > 0 && msgs[0].GetRequestHeaders() == nil {
		// Most chaos still starts like a request, so the body paths are reached.
		msgs = append([]*extprocv3.ProcessingRequest{envoymsg.Headers(envoymsg.Request, false,
			[2]string{":method", "POST"}, [2]string{":path", "/v1/chat/completions"})}, msgs...)
	}
	return msgs
}

func (g *fuzzGen) path(i int) string {
	switch i % 8 {
	case 0:
		return "/v1/chat/completions"
	case 1:
		return "/v1/completions"
	case 2:
		return "/flush_cache" // an engine admin path: 404
	case 3:
		return "/v1/chat/completions?api-version=1"
	case 4:
		return ""
	case 5:
		return "/v1/embeddings" // pass-through, scrubbed like any leg
	case 6:
		return "/inference/v1/generate"
	}
	return "/" + string(g.data.take(int(g.data.next())%16))
}

// body returns a request body: mostly the OpenAI shapes, some hostile, some raw data.
func (g *fuzzGen) body(template int, stream bool) []byte {
	s, _ := json.Marshal(string(g.data.take(int(g.data.next()))))
	switch template % 8 {
	case 0:
		return fmt.Appendf(nil, `{"model":"m","messages":[{"role":"user","content":%s}],"stream":%v,"max_tokens":5}`, s, stream)
	case 1:
		return fmt.Appendf(nil, `{"model":"m","prompt":%s,"stream":%v}`, s, stream)
	case 2: // everything a client must not steer with, duplicated, escaped and nested
		return fmt.Appendf(nil, `{"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"6.6.6.6"},"model":"m",`+
			`"messages":[{"role":"user","content":%s,"kv_transfer_params":{"nested":true}}],`+
			`"kv\u005ftransfer_params":{"remote_port":666},"bootstrap_host":"6.6.6.6","bootstrap_port":666,`+
			`"bootstrap_room":"x","bootstrap\u005froom":7,"stream":%v,"kv_transfer_params":null}`, s, stream)
	case 3:
		return g.data.take(int(g.data.next()) * 4)
	case 4:
		return nil
	case 5:
		return fmt.Appendf(nil, `{"model":"m","prompt":%s,"n":2}`, s)
	case 6:
		return fmt.Appendf(nil, `{"prompt":%s}`, s)
	}
	// Longer than one FULL_DUPLEX reply chunk (62,000 bytes).
	return fmt.Appendf(nil, `{"model":"m","prompt":"%s%s","stream":%v}`, strings.Repeat("a", 70_000), s[1:len(s)-1], stream)
}
