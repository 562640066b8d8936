package pipeline_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// The prefill leg goes out whole with its Content-Length (not chunked), joined
// or from its pieces, over HTTP/1.1 or, when asked, HTTP/2 cleartext.
func TestPrefillLegSpeaksHTTP2CleartextWhenAsked(t *testing.T) {
	var proto atomic.Int32
	var got atomic.Value // the leg as the engine read it
	engine := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		proto.Store(int32(r.ProtoMajor))
		b, _ := io.ReadAll(r.Body)
		got.Store(fmt.Sprintf("%d %s", r.ContentLength, b))
		io.WriteString(w, `{"kv_transfer_params":{"remote_host":"10.0.0.9"}}`)
	}))
	engine.Config.Protocols = new(http.Protocols)
	engine.Config.Protocols.SetHTTP1(true)
	engine.Config.Protocols.SetUnencryptedHTTP2(true)
	engine.Start()
	defer engine.Close()

	for _, tt := range []struct {
		http2     bool
		wantProto int32
	}{{false, 1}, {true, 2}} {
		t.Run(fmt.Sprintf("http2=%v", tt.http2), func(t *testing.T) {
			p := newNIXL(t, strings.TrimPrefix(engine.URL, "http://"), fmt.Sprintf("{on_failure: fail, http2: %v}", tt.http2))
			for _, prompt := range []string{"hi", strings.Repeat("x", pipeline.MaxJoinedLeg)} {
				d, err := p.Route(context.Background(), &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/completions", RequestID: "r1", Body: []byte(`{"model":"m","prompt":"` + prompt + `"}`)})
				if err != nil {
					t.Fatal(err)
				}
				d.Release()
				if got := proto.Load(); got != tt.wantProto {
					t.Errorf("the engine saw HTTP/%d, want HTTP/%d", got, tt.wantProto)
				}
				leg := `{"model":"m","prompt":"` + prompt + `","kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,` +
					`"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null},"stream":false,"max_tokens":1,"min_tokens":1}`
				if got, want := got.Load(), fmt.Sprintf("%d %s", len(leg), leg); got != want {
					t.Errorf("the engine read Content-Length and body\n%.200s\nwant\n%.200s", got, want)
				}
			}
		})
	}
}
