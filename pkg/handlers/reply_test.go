package handlers_test

import (
	"errors"
	"slices"
	"testing"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
)

// Each phase answers with a reply value, which only the exchange's send puts
// on the stream: here the values themselves, phase by phase. kinds names each
// message of a reply: headers (request headers, with the routing when
// "routed"), chunk (a request body chunk, "+eos" on the last), the continue
// replies, immediate (a local reply).
func TestPhasesReturnTheirReplies(t *testing.T) {
	const (
		duplex   = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
		buffered = filterv3.ProcessingMode_BUFFERED
	)
	decoded := []byte(`{"model":"m","prompt":"hi","kv_transfer_params":{}}`) // the decode leg's body
	post := envoymsg.Post("/v1/completions", 27)
	client := []byte(`{"model":"m","prompt":"hi"}`)
	tests := []struct {
		name      string
		mode      filterv3.ProcessingMode_BodySendMode
		routeErr  error
		before    []*extprocv3.ProcessingRequest // handled and sent first
		msg       *extprocv3.ProcessingRequest
		wantKinds []string
		wantAfter bool // the request is concluded as routed once the reply is sent
		wantDone  bool
	}{
		{name: "FULL_DUPLEX headers: the reply waits for the body", mode: duplex,
			msg: envoymsg.Headers(envoymsg.Request, false, post...)},
		{name: "BUFFERED headers: an empty headers reply", mode: buffered,
			msg: envoymsg.Headers(envoymsg.Request, false, post...), wantKinds: []string{"headers"}},
		{name: "headers without a body: routed at once", mode: duplex,
			msg: envoymsg.Headers(envoymsg.Request, true, envoymsg.Post("/v1/models", 0)...), wantKinds: []string{"headers routed"}, wantAfter: true},
		{name: "FULL_DUPLEX last chunk: the routing, then the new body", mode: duplex,
			before: []*extprocv3.ProcessingRequest{envoymsg.Headers(envoymsg.Request, false, post...)},
			msg:    envoymsg.Body(envoymsg.Request, client, true), wantKinds: []string{"headers routed", "chunk+eos"}, wantAfter: true},
		{name: "FULL_DUPLEX body ended by trailers", mode: duplex,
			before: []*extprocv3.ProcessingRequest{envoymsg.Headers(envoymsg.Request, false, post...), envoymsg.Body(envoymsg.Request, client, false)},
			msg:    envoymsg.Trailers(envoymsg.Request), wantKinds: []string{"headers routed", "chunk", "continue request trailers"}, wantAfter: true},
		{name: "BUFFERED body: one body reply with the routing", mode: buffered,
			before: []*extprocv3.ProcessingRequest{envoymsg.Headers(envoymsg.Request, false, post...)},
			msg:    envoymsg.Body(envoymsg.Request, client, true), wantKinds: []string{"body routed"}, wantAfter: true},
		{name: "a routing error: the local reply, and the stream is done", mode: duplex, routeErr: errors.New("no endpoint"),
			before: []*extprocv3.ProcessingRequest{envoymsg.Headers(envoymsg.Request, false, post...)},
			msg:    envoymsg.Body(envoymsg.Request, client, true), wantKinds: []string{"immediate"}, wantDone: true},
		// Envoy sends no body message for a request that carries none before
		// its trailers (HTTP/2 HEADERS, then trailers): in FULL_DUPLEX a body
		// reply would be a spurious message (500), and in BUFFERED the
		// trailers reply would let the headers, answered without routing,
		// reach the router with whatever destination the client named.
		{name: "FULL_DUPLEX trailers with no body: no body reply", mode: duplex,
			before: []*extprocv3.ProcessingRequest{envoymsg.Headers(envoymsg.Request, false, envoymsg.Post("/v1/models", -1)...)},
			msg:    envoymsg.Trailers(envoymsg.Request), wantKinds: []string{"headers routed", "continue request trailers"}, wantAfter: true},
		{name: "BUFFERED trailers with no body: refused", mode: buffered,
			before: []*extprocv3.ProcessingRequest{envoymsg.Headers(envoymsg.Request, false, envoymsg.Post("/v1/models", -1)...)},
			msg:    envoymsg.Trailers(envoymsg.Request), wantKinds: []string{"immediate"}, wantDone: true},
		{name: "request trailers after a whole body", mode: buffered,
			before: []*extprocv3.ProcessingRequest{envoymsg.Headers(envoymsg.Request, false, post...), envoymsg.Body(envoymsg.Request, client, true)},
			msg:    envoymsg.Trailers(envoymsg.Request), wantKinds: []string{"continue request trailers"}},
		{name: "response headers", mode: duplex,
			msg: envoymsg.Headers(envoymsg.Response, false), wantKinds: []string{"continue response headers"}},
		{name: "a BUFFERED response body", mode: buffered,
			msg: envoymsg.Body(envoymsg.Response, []byte("tokens"), true), wantKinds: []string{"continue response body"}},
		{name: "a FULL_DUPLEX response chunk, echoed", mode: duplex,
			msg: envoymsg.Body(envoymsg.Response, []byte("data: tok\n\n"), false), wantKinds: []string{"response chunk"}},
		{name: "response trailers", mode: duplex,
			msg: envoymsg.Trailers(envoymsg.Response), wantKinds: []string{"continue response trailers"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &fakeRouter{err: tt.routeErr, decode: func([]byte) body.Spliced { return body.Spliced{decoded} }}
			s := handlers.NewServer(r, handlers.Options{}, logr.Discard())
			x := s.Open(t.Context(), newRecorder())
			defer x.Close()
			msgs := append(tt.before, tt.msg)
			msgs[0] = envoymsg.WithModes(msgs[0], tt.mode, tt.mode)
			for _, m := range msgs[:len(msgs)-1] {
				if _, err := x.Handle(m); err != nil {
					t.Fatal(err)
				}
			}
			got, after, done := x.Phase(msgs[len(msgs)-1])
			var kinds []string
			for _, m := range got {
				kinds = append(kinds, kind(m))
			}
			if !slices.Equal(kinds, tt.wantKinds) || after != tt.wantAfter || done != tt.wantDone {
				t.Fatalf("reply %v, after %v, done %v; want %v, %v, %v", kinds, after, done, tt.wantKinds, tt.wantAfter, tt.wantDone)
			}
			for _, m := range got {
				if c := m.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody(); len(c) > 0 && &c[0] != &decoded[0] {
					t.Error("the request body chunk is a copy, not the decode leg's own bytes")
				}
			}
		})
	}
}

// kind names a reply as TestPhasesReturnTheirReplies does.
func kind(m *extprocv3.ProcessingResponse) string {
	routed := func(c *extprocv3.CommonResponse) string {
		for _, h := range c.GetHeaderMutation().GetSetHeaders() {
			if h.GetHeader().GetKey() == handlers.DestinationHeader && string(h.GetHeader().GetRawValue()) == fakeEndpoint {
				return " routed"
			}
		}
		return ""
	}
	switch r := m.Response.(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		return "headers" + routed(r.RequestHeaders.GetResponse())
	case *extprocv3.ProcessingResponse_RequestBody:
		if s := r.RequestBody.GetResponse().GetBodyMutation().GetStreamedResponse(); s != nil {
			if s.GetEndOfStream() {
				return "chunk+eos"
			}
			return "chunk"
		}
		return "body" + routed(r.RequestBody.GetResponse())
	case *extprocv3.ProcessingResponse_RequestTrailers:
		return "continue request trailers"
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		return "continue response headers"
	case *extprocv3.ProcessingResponse_ResponseBody:
		if r.ResponseBody.GetResponse().GetBodyMutation().GetStreamedResponse() != nil {
			return "response chunk"
		}
		return "continue response body"
	case *extprocv3.ProcessingResponse_ResponseTrailers:
		return "continue response trailers"
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		return "immediate"
	}
	return "?"
}
